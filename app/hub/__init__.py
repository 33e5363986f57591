"""Model hub access for the GUI process: browse EXL2 quants, estimate fit, download, manage local models.

Pure Python (no Qt, no torch): progress arrives as callbacks; `app/models_dialog.py` turns them into signals.
"""
