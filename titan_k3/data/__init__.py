"""Data: tokenizers, the shard format, the embedded corpus, the stateful loader and the prepare pipeline."""
