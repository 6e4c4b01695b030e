"""One line, once, when the training left is projected past LONG_RUN_SECONDS."""
import time

import jax

from jaxtrain.runtime import processes

LONG_RUN_SECONDS = 600  # training projected past this: say so, once


class Projection:
    """Projects the training left from the first steps timed (after the first compiled
    call of a chunk, which may carry first-run costs): after a few steps of the first
    chunk, or at its end. On a CPU the line names the recipes sized for one."""

    def __init__(self, total_steps: int, model_name: str, say):
        self.total_steps, self.model_name, self.say = total_steps, model_name, say
        self.said = not processes.is_main_process()
        self.mark = None  # (time, steps done) where the timing starts

    def during(self, previous: int, done: int, metrics) -> None:
        """After `done` steps of the chunk that started after step `previous`."""
        if self.said:
            return
        if self.mark is None:  # a new chunk: the timing starts here
            jax.block_until_ready(metrics)  # dispatch runs ahead: time finished steps
            self.mark = (time.perf_counter(), done)
            return
        began, at = self.mark
        if done - at >= 3 or time.perf_counter() - began >= 10:
            jax.block_until_ready(metrics)
            self.project((time.perf_counter() - began) / (done - at), previous + done)

    def after(self, chunk) -> None:
        self.mark = None
        if chunk.step > chunk.previous:
            self.project(chunk.seconds / (chunk.step - chunk.previous), chunk.step)

    def project(self, seconds_per_step: float, step: int) -> None:
        if self.said:
            return
        self.said = True
        left = self.total_steps - step
        seconds = left * seconds_per_step
        if seconds <= LONG_RUN_SECONDS:
            return
        line = (f"projected: about {duration(seconds)} of training left ({left:,} steps at "
                f"{seconds_per_step:.3g} s a step on {jax.devices()[0].device_kind}; "
                "evaluations not counted)")
        if jax.default_backend() == "cpu":
            narrower = ("a narrower cifar_cnn (--config.model.widths=(16,32,64)), "
                        if self.model_name == "cifar_cnn" else "")
            line += (f". This recipe is sized for a GPU; on a CPU, {narrower}"
                     "configs/fashion_mnist_cnn.py, configs/cifar_seed_cnn.py or "
                     "configs/fashion_mnist_mlp.py train in minutes")
        self.say(line)


def duration(seconds: float) -> str:
    """'3 h 20 min', '45 min'."""
    minutes = round(seconds / 60)
    return f"{minutes // 60} h {minutes % 60} min" if minutes >= 60 else f"{minutes} min"
