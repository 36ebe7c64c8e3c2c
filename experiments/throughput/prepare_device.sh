#!/usr/bin/env bash
# Prepares, here, what a lent GPU machine lacks for experiments/throughput/gpu.py (see the README beside this file):
# hydra-core, omegaconf and antlr4's runtime (and pytest with its plugins of requirements.txt, for the GPU tests, and the
# submitit launcher that hydra_plugins/ imports) as wheels in .whl/; the Multi30k files
# and their encoded corpus, and the tests' encoded corpus (spaCy words, made here: the GPU machine has no spaCy), in
# .gpu/. Both folders are git-ignored through .git/info/exclude.
#
#   MULTI30K_ROOT=../shared/data/multi30k [PYTHON=.venv/bin/python] bash experiments/throughput/prepare_device.sh
#
# Then one device run, carrying .whl and .gpu (about 9 MB): the README beside this file has the command.
set -euo pipefail
cd "$(dirname "$0")/../.."
root="${MULTI30K_ROOT:-../shared/data/multi30k}"
python="${PYTHON:-python3}"  # the environment of requirements.txt
[ -f "$root/train.de.gz" ] || { echo "error: $root has no Multi30k files (set MULTI30K_ROOT)" >&2; exit 1; }

mkdir -p .git/info
for folder in /.whl/ /.gpu/; do
  grep -qxF "$folder" .git/info/exclude 2>/dev/null || echo "$folder" >> .git/info/exclude
done
rm -rf .whl .gpu
mkdir -p .whl .gpu/multi30k .gpu/cache .gpu/testcache

# pure-Python packages, the versions of requirements.txt; antlr4's runtime is published as a source archive only
"$python" -m pip download -q --no-deps --only-binary=:all: -d .whl hydra-core==1.3.8 omegaconf==2.3.1 \
  pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pygments==2.21.0 packaging==26.4 pytest-xdist==3.8.0 execnet==2.1.2 \
  pytest-rerunfailures==16.7 \
  hydra-submitit-launcher==1.2.0 submitit==1.5.4 cloudpickle==3.1.3  # hydra_plugins/ imports them: without, each train.py start warns
"$python" -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3

cp "$root"/*.gz .gpu/multi30k/
# the encoded corpus of gpu.py's runs (experiment=throughput_ref) and of the memory-strategy table (the same spaCy
# settings), by this commit's code: the cache is keyed by the encoding code, so prepare again after changing it
MT_CACHE_DIR=.gpu/cache MULTI30K_ROOT=.gpu/multi30k "$python" plan.py experiment=throughput_ref > /dev/null
# the synthetic corpus of the tests' runs (tests/conftest.py: MT_TEST_CACHE), through one of them
MT_TEST_CACHE=.gpu/testcache "$python" -m pytest -q -n 0 -p no:cacheprovider tests/test_train_e2e.py -k tiny_run_writes \
  > /dev/null
ls .whl .gpu/cache
du -sh .whl .gpu
