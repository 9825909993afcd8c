"""What an evaluation run has fitted, so that a run cut off can be resumed (run_eval
--reuse_fits). Standard library only."""

import json
import os


class FitsDone:
    """What an evaluation run has fitted, one JSON file per fit under `directory` (its wall
    seconds, for --kind both also its fit report), written once the fit's outputs are complete,
    so that a run cut off (a session's end, a crash) can be resumed with --reuse_fits: a fit with
    a record and its outputs in place is kept, every other one fitted again."""

    def __init__(self, directory, reuse):
        self.directory, self.reuse, self.reused = directory, reuse, 0
        os.makedirs(directory, exist_ok=True)
        if not reuse:  # a fresh run: earlier records describe fits it is about to replace
            for name in os.listdir(directory):
                os.remove(os.path.join(directory, name))

    def get(self, name, outputs):
        """The record of fit `name` if resuming and it and every one of `outputs` (mapper
        directories) are there, else None."""
        path = os.path.join(self.directory, name + ".json")
        if not self.reuse or not os.path.exists(path) or not all(
                os.path.exists(os.path.join(o, "manifest.yaml")) for o in outputs):
            return None
        with open(path) as f:
            record = json.load(f)
        self.reused += 1
        return record

    def put(self, name, record):
        tmp = os.path.join(self.directory, name + ".json.tmp")
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, os.path.join(self.directory, name + ".json"))

    def seconds_total(self, phase):
        """The wall seconds of every recorded fit of `phase`, summed."""
        total = 0.0
        for name in os.listdir(self.directory):
            if name.endswith(".json"):
                with open(os.path.join(self.directory, name)) as f:
                    record = json.load(f)
                total += record["seconds"] if record["phase"] == phase else 0.0
        return total
