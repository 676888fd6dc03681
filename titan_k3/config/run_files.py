"""What a trainer run writes at the top of its run directory (checkpoints live in their own folder, checkpoint.folder).

One list for everything that needs it, torch-free so the control service can read it: the run (job.overwrite removes
all of it, so nothing of a previous run reads as the new one's; a reused name holding RUN_FILES has a previous run),
validation (checkpoint.folder cannot start with one of these names), and the service (it sets a crashed attempt's
records aside before a relaunch). The tools that read a run write here too: offline evaluation's eval_table.md,
summarize's summary/.
"""

RUN_FILES = ("config.toml", "manifest.json", "metrics.jsonl", "events.jsonl", "stdout.log", "eval_table.md")
RUN_FILE_PATTERNS = ("profile-rank*.txt", "trace-rank*.json*", "memory-peak-rank*.md", "events.out.tfevents.*")
RUN_FOLDERS = ("tensorboard", "summary")
RUN_DIR_NAMES = RUN_FILES + RUN_FILE_PATTERNS + RUN_FOLDERS
"""Names and glob patterns, all of the above."""
