"""The torch backend: the diffusers and transformers modules themselves, with our kernels substituted into them,
channels-last memory, CUDA graphs and torch.compile as its settings say (options.py, light; settings.py), one
TorchStage each (stage.py); the backend object (backend.py)."""
