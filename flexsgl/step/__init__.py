"""A step's parts, from a scheduled batch to the device (flexsgl/runner.py runs them; their shapes
are flexsgl/step_shape.py's).

plan.py          StepPlan: the step's host lists (picklable: every tensor-parallel rank runs it)
inputs.py        the plan's packed uploads, as a ForwardBatch and sampling tensors (graphed or direct)
graphs.py        GraphManager: the CUDA graphs' static buffers, capture and replay
token_buffer.py  each running request's last token on the device, and the padding rows' slot
output.py        a launched step on its way to the host (StepOutput), or waiting for its token mask (DeferredStep)
"""
