"""nn.Modules over compressed weights: `UnweightLinear` and `ArchiveLinear` (linear.py), `UnweightExperts`
(experts.py), the autotuner that picks their pipelines (autotune.py) and host-to-device copies (transfer.py).
They call the kernels (../kernels/); the model (../model/) and the integrations build on them."""
