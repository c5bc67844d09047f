"""torch.profiler on a window of steady-state steps (`profile:`): a Chrome/TensorBoard trace and a table of the
top operators in OUTPUT/profile/, and on a GPU a CUDA memory snapshot (`profile.memory`).

The window starts after `profile.start_step` steps (compilation, allocator warm-up and the first data loads are
over by then) and covers `profile.steps` optimizer steps; rank 0 profiles, or every rank with `profile.ranks: all`
(each writes its own files). Profiling slows the steps it covers, so their throughput in metrics.jsonl is not the
run's; the steps themselves compute the same numbers.

A resumed run whose step is already past `profile.start_step` (profile.* may change on resume) and that has no
profile yet profiles after `profile.start_step` steps of its own: a new process warms up again. The files name the
steps profiled (fewer than `profile.steps` when the run ends inside the window). Writing them is best effort: a
failure (disk full, say) is one warning, and the run goes on to its checkpoint.
"""
from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any, Iterator

import torch

from bertrain.train.config import ProfileConfig
from bertrain.train.distributed import DistInfo
from bertrain.utils.io import atomic_write_text

log = logging.getLogger(__name__)

PROFILE_DIR = "profile"


class StepProfiler:
    """`step_begin(step)` before each optimizer step, `step_end(step)` after it (step = steps done before it)."""

    def __init__(self, cfg: ProfileConfig, dist: DistInfo, out: Path) -> None:
        self.cfg, self.dist, self.out = cfg, dist, out / PROFILE_DIR
        self.active = cfg.enabled and (cfg.ranks == "all" or dist.is_main)
        self.cuda = dist.device.type == "cuda"
        self.prof: Any = None
        self.first = cfg.start_step  # the step count at which the window opens
        self.last = cfg.start_step + cfg.steps
        self.begun: int | None = None  # the step count of this process's first step
        self.seen = 0  # the step count before the latest step
        self.done = 0  # steps completed inside the window
        self.activities: list[Any] = []

    def step_begin(self, step: int) -> None:
        self.seen = step
        if self.begun is None:
            self.begun = step
            if self.active and step > self.first:  # resumed past the window's start
                done = sorted(p.name for p in self.out.glob(f"rank{self.dist.rank}.steps*.top-ops.txt"))
                if done:  # an earlier process of this run profiled: once is enough
                    log.info("resumed at step %d, past profile.start_step = %d, and %s has a profile (%s): not "
                             "profiling again (move it away to profile this run)", step, self.first, self.out,
                             done[-1])
                    self.active = False
                else:  # this process warms up first
                    log.info("resumed at step %d, past profile.start_step = %d: profiling steps %d-%d instead",
                             step, self.first, step + self.cfg.start_step + 1,
                             step + self.cfg.start_step + self.cfg.steps)
                    self.first = step + self.cfg.start_step
                    self.last = self.first + self.cfg.steps
        if not self.active or step != self.first or self.prof is not None:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            if self.cfg.memory:  # every allocation from here on, with its stack, for the snapshot
                torch.cuda.memory._record_memory_history(max_entries=100_000)
        self.activities = activities
        self.prof = torch.profiler.profile(activities=activities, record_shapes=self.cfg.record_shapes,
                                           profile_memory=True, with_stack=self.cfg.with_stack)
        self.prof.__enter__()
        log.info("profiling steps %d-%d on rank %d", self.first + 1, self.last, self.dist.rank)

    def step_end(self, step: int) -> None:
        if self.prof is None:
            return
        self.prof.step()
        self.done = step - self.first
        if step >= self.last:
            self.finish()

    @contextlib.contextmanager
    def outside_steps(self) -> Iterator[None]:
        """Around what runs between two steps inside the window (an evaluation, a checkpoint): not collected, so
        the trace and the top-ops table are the steps' (an evaluation's forward passes were 3/4 of a window's
        log_softmax calls)."""
        if self.prof is None:
            yield
            return
        self.prof.toggle_collection_dynamic(False, self.activities)
        try:
            yield
        finally:
            if self.prof is not None:
                self.prof.toggle_collection_dynamic(True, self.activities)

    def finish(self) -> None:
        """Stop and write the files (also when the run ends inside the window); a failure is a warning."""
        if self.prof is None:
            if self.active and self.begun is not None and self.seen + 1 <= self.first:  # the run ended before it
                log.warning("profile.start_step = %d was never passed: the run ended at step %d, so nothing was "
                            "profiled (lower profile.start_step)", self.first, self.seen + 1)
                self.active = False
            return
        prof, self.prof, self.active = self.prof, None, False
        window = f"steps{self.first + 1}-{self.first + max(self.done, 1)}"  # the steps profiled
        try:
            self._write(prof, window)
        except Exception as e:  # diagnostics: never the reason a run fails or loses its last checkpoint
            log.warning("could not write the profile of %s to %s (%s: %s); training goes on without it", window,
                        self.out, type(e).__name__, (str(e).splitlines() or [""])[0][:300])
            if self.cuda and self.cfg.memory:
                try:
                    torch.cuda.memory._record_memory_history(enabled=None)
                except Exception:  # noqa: BLE001 - already warned
                    pass

    def _write(self, prof: Any, window: str) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        prof.__exit__(None, None, None)
        self.out.mkdir(parents=True, exist_ok=True)
        rank = self.dist.rank
        # *.pt.trace.json: the name TensorBoard's profiler plugin looks for; chrome://tracing and Perfetto read it too
        trace = self.out / f"rank{rank}.{window}.pt.trace.json"
        partial = trace.with_name(f".{trace.name}.partial")
        try:
            prof.export_chrome_trace(str(partial))
            os.replace(partial, trace)  # whole or absent
        finally:
            partial.unlink(missing_ok=True)  # no half-written trace left behind (disk full)
        sort = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=self.cfg.top)
        atomic_write_text(self.out / f"rank{rank}.{window}.top-ops.txt", table + "\n")
        written = [trace.name, f"rank{rank}.{window}.top-ops.txt"]
        if self.cuda and self.cfg.memory:
            snapshot = self.out / f"rank{rank}.{window}.memory-snapshot.pickle"  # https://pytorch.org/memory_viz
            torch.cuda.memory._dump_snapshot(str(snapshot))
            torch.cuda.memory._record_memory_history(enabled=None)
            written.append(snapshot.name)
        log.info("profile of %s written to %s: %s", window.replace("steps", "steps "), self.out, ", ".join(written))
