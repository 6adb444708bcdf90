"""The types every other package shares, and nothing else: a request and its sampling
parameters (`request`), the rows one step runs (`batch`), what a step hands back (`outputs`),
the engine's counters (`stats`) and the checks a request passes before it is queued
(`validation`). This package imports no other package of the engine."""
