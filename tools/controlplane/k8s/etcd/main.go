// etcd server of the version k8s.io/kubernetes itself requires (Debian 12 ships 3.4, older than a
// current kube-apiserver expects).
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
