"""Test helper shared by the KDA kernel tests: the launch table changed for the duration of a with block."""

from kernels.kda import ops


class launch_settings:
    """ops.LAUNCH entries replaced for the duration of a with block (keyword: kernel name -> settings)."""

    def __init__(self, **changes):
        self.changes = changes

    def __enter__(self):
        self.kept = {name: ops.LAUNCH[name] for name in self.changes}
        ops.LAUNCH.update({name: {**ops.LAUNCH[name], **c} for name, c in self.changes.items()})

    def __exit__(self, *exc):
        ops.LAUNCH.update(self.kept)
