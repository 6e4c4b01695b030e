"""WandbTracker (logging.wandb): params, rows and the summary in a Weights & Biases run;
wandb is imported only when the key is set (pip install 'jaxtrain[wandb]')."""
import os

from jaxtrain.callbacks.trackers import tracker


class WandbTracker(tracker.Tracker):
    """logging.wandb = a project name; logging.wandb_mode 'offline' (no network: the run
    stays in WORKDIR/wandb for `wandb sync`) or 'online'."""
    name = "wandb"

    def __init__(self, project: str, mode: str = "offline"):
        self.wandb = tracker.import_optional("wandb", "wandb")
        self.project, self.mode = project, mode

    def start(self, run, run_id):
        self.run = self.wandb.init(
            project=self.project, mode=self.mode, dir=os.path.abspath(run.workdir),
            name=os.path.basename(os.path.abspath(run.workdir)), id=run_id,
            resume="allow" if run_id else None, config=tracker.flat_config(run.config))
        if run_id is None:
            self.keep_id(self.run.id)

    def log(self, rows):
        for step, metrics in rows:
            self.run.log(metrics, step=step)

    def end(self, summary):
        self.run.summary.update(tracker.summary_metrics(summary))
        self.run.finish()

    def stop(self, signum):
        """A signal: preempted, with the process's exit status (128 + N); else status 1."""
        if signum:
            self.run.mark_preempting()
        self.run.finish(exit_code=128 + signum if signum else 1)
