"""titan_k3: pretraining for the Kimi K3 model family."""
