//go:build tools

// Keeps the operator's command package in go.mod/go.sum so `go mod tidy` does not drop it.
package tools

import _ "github.com/ray-project/kuberay/ray-operator"
