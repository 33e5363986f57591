"""The EXL2 format in pure PyTorch: format (dequantize / quantize), bitpack, writer (streaming model
folders, quantize_model), shapes + synth + synth_tokenizer (`moedesk-cli synth`).

Importing this package does not import torch; format, bitpack and writer do.
"""
