"""The prepare pipeline: raw text sources -> filtered, deduplicated, decontaminated shards.

Run ``python -m titan_k3.data.prepare --config data.toml``; see `config` for the keys
and `pipeline` for the stages and how a killed run resumes.
"""
