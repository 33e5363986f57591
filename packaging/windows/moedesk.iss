; Inno Setup script for MoE Desk: installs the PyInstaller bundle (dist\moedesk) per user,
; with a Start-menu shortcut and an optional desktop icon. Built by build-windows.ps1.
#define AppName "MoE Desk"
#define AppVersion "0.1.0"

[Setup]
AppId={{6A0C1F3E-2B7D-4E55-9A51-5E0D6A1C7B21}
AppName={#AppName}
AppVersion={#AppVersion}
AppPublisher=MoE Desk
DefaultDirName={localappdata}\Programs\MoE Desk
DefaultGroupName={#AppName}
PrivilegesRequired=lowest
OutputDir=..\..\dist
#ifdef Gpu
; The GPU bundle (CUDA torch, prebuilt exllamav2 kernels) is over 2 GB: split into setup-1.bin, ...
OutputBaseFilename=MoEDesk-{#AppVersion}-cuda-setup
DiskSpanning=yes
#else
OutputBaseFilename=MoEDesk-{#AppVersion}-setup
#endif
SetupIconFile=..\..\build\moedesk.ico
Compression=lzma2
SolidCompression=yes
ArchitecturesInstallIn64BitMode=x64compatible
WizardStyle=modern

[Tasks]
Name: "desktopicon"; Description: "Create a desktop icon"; GroupDescription: "Additional icons:"; Flags: unchecked

[Files]
Source: "..\..\dist\moedesk\*"; DestDir: "{app}"; Flags: ignoreversion recursesubdirs createallsubdirs

[Icons]
Name: "{group}\{#AppName}"; Filename: "{app}\moedesk.exe"
Name: "{group}\Uninstall {#AppName}"; Filename: "{uninstallexe}"
Name: "{autodesktop}\{#AppName}"; Filename: "{app}\moedesk.exe"; Tasks: desktopicon

[Run]
Filename: "{app}\moedesk.exe"; Description: "Start {#AppName}"; Flags: nowait postinstall skipifsilent
