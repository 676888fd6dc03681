"""A Trainer of the tiny flavor on the GPU for the tests that compare two of them (step graph, weight shadows)."""


def tiny_trainer(tmp_path, name: str, *args: str):
    """Trainer of `--model.flavor tiny` on CUDA under tmp_path/name, quiet metrics, with the test's own `args`."""
    from titan_k3.config import load_job_config
    from titan_k3.train import Trainer

    return Trainer(load_job_config(["--model.flavor", "tiny", "--training.device", "cuda", "--metrics.log_freq", "1000",
                                    "--job.dump_folder", str(tmp_path), "--job.name", name, *args]))
