"""A step's parts, from a scheduled batch to the device (the runner, flexsgl/runner.py, runs them).

shape.py         StepShape: rows (padding to buckets), page-table width, which steps replay a graph
plan.py          StepPlan: the step's host lists (picklable: every tensor-parallel rank runs it)
inputs.py        the plan's packed uploads, as a ForwardBatch and sampling tensors (graphed or direct)
token_buffer.py  each running request's last token on the device, and the padding rows' slot
"""
