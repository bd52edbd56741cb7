#!/usr/bin/env bash
# The chain of the H100 call of 2026-12-06 (issue #60), most needed first, run in the background across device
# calls: `bash .gpu/tree/benchmarks/device_window.sh 575 .gpu/tree/benchmarks/device_chain_issue60.sh` from the
# checkout root, .gpu/ as device_run.sh describes (old-afa43bd/: `git archive afa43bd app`). Results: /tmp/chain/.
set -u
G=$1 T=$1/tree C=/tmp/chain
skip() { [[ ",${SKIP:-}," == *",$1,"* ]]; }  # steps done on an earlier machine
step() { echo "[$(date +%T)] $1 start" >> $C/steps.txt; }
done_() { echo "[$(date +%T)] $1 done rc=$2" >> $C/steps.txt; }
skip defaults && skip dpo && [ ! -d /tmp/site/ray ] && { mkdir -p /tmp/site && tar -C /tmp/site -xJf $G/site-py312.tar.xz &&
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $G/whl/*.whl; }
skip prepare || (cd $T && PYTHONPATH=$T nice -n 19 python3 -m benchmarks.prepare_bench --data-only --work /tmp/pbw > $C/pbw.log 2>&1) &
Q3=defaults-chat-q3-17-full,trl-defaults-chat-q3-17-full,trl-defaults-chat-q3-17-full-ckpt,defaults-chat-q3-17-lora,trl-defaults-chat-q3-17-lora,trl-defaults-chat-q3-17-lora-ckpt
skip defaults || { step defaults; BENCH_PROFILE_DRIVER=60 PATH=/tmp/site/bin:$PATH OUT=$C bash $T/benchmarks/device_run.sh defaults 400 $Q3 > $C/defaults.txt 2>&1; done_ defaults $?; }
mv $C/defaults/ray-logs.tar.gz $C/defaults-ray-logs.tgz 2>/dev/null
skip dpo || { step dpo; OUT=$C bash $T/benchmarks/device_run.sh trl 200 dpo-l1b-lora-z0-pure,trl-dpo-l1b-lora > $C/trl.txt 2>&1; done_ dpo $?; }
rm -f $C/trl/ray-logs.tar.gz
cd $T && export PYTHONPATH=$T/benchmarks/image_env:$T:/tmp/site TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
step longest; for k in --lora --full; do timeout 90 python3 -m benchmarks.longest $k >> $C/longest.txt 2>&1; done
python3 -c "import torch; p=torch.cuda.get_device_properties(0); print('torch', p.name, p.total_memory)" >> $C/longest.txt 2>&1
free -b >> $C/longest.txt; done_ longest 0
wait  # the prepare data
skip prepare || { step prepare; python3 -m benchmarks.prepare_bench --kinds text,chat --old-procs 16 --old-tree $G/old-afa43bd --work /tmp/pbw \
  --out $C/prepare.jsonl --note "GPU host, issue #60 item 1" > $C/prepare.txt 2>&1; done_ prepare $?; }
big=$(python3 -c "import torch; print(int(torch.cuda.get_device_properties(0).total_memory > 100 * 2**30))")
[ "$big" = 1 ] && LONGEST=long-l8b-512k || LONGEST=long-l8b-320k
cd $G/.. && step long; OUT=$C bash $T/benchmarks/device_run.sh long 2000 long-l8b-128k,trl-long-l8b-128k,$LONGEST > $C/long.txt 2>&1; done_ long $?
rm -f $C/long/ray-logs.tar.gz
echo ALL >> $C/steps.txt
