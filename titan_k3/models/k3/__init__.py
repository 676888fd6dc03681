"""The Kimi K3 model family. `args` is torch-free; `model` builds the network."""
