"""Staying alive and saying so: preemption signals turned into a final checkpoint (:mod:`.preemption`),
ranks agreeing on the step they stop at (:mod:`.preemption_watch`), a rank's status file
(:mod:`.run_status`) and whether a process is alive (:mod:`.liveness`).
"""
