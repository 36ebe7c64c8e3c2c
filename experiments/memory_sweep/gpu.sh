#!/usr/bin/env bash
# experiment=memory_sweep on a lent GPU machine (experiments/memory_sweep/README.md, "On a GPU"):
#
#   bash experiments/memory_sweep/gpu.sh OUT model=base trainer.device=cuda trainer.max_steps=300 trainer.eval_every=300
#
# Runs the preset's sweep on Multi30k (MULTI30K_ROOT; the encoded corpus from MT_CACHE_DIR where the machine has no
# spaCy: experiments/throughput/prepare_device.sh makes both) with W&B off (the lent machine has no wandb), then
# puts into OUT what comes back from such a machine, a few files: report.md and report.png (the sweep's report),
# summaries.json (every job's summary.json, by job) and sweep.log. The run directories go to a temporary folder,
# removed at the end: model=base's checkpoints are hundreds of MB each. Exits with the sweep's status.
set -uo pipefail
out="${1:?usage: gpu.sh OUT [overrides...]}"
shift
cd "$(dirname "$0")/../.."
mkdir -p "$out"
sweep="$(mktemp -d)/sweep"
python3 train.py -m experiment=memory_sweep data=multi30k logger=none trainer.progress=false \
  "hydra.sweep.dir=$sweep" "$@" > "$out/sweep.log" 2>&1
status=$?
cp "$sweep"/report.md "$sweep"/report.png "$out"/ 2>/dev/null
python3 - "$sweep" "$out/summaries.json" <<'EOF'
import json
import sys
from pathlib import Path

sweep, into = Path(sys.argv[1]), Path(sys.argv[2])
jobs = sorted((p for p in sweep.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
into.write_text(json.dumps({p.name: json.loads((p / "summary.json").read_text()) if (p / "summary.json").is_file()
                            else None for p in jobs}, indent=1) + "\n")
EOF
rm -rf "$(dirname "$sweep")"
tail -12 "$out/sweep.log"
exit $status
