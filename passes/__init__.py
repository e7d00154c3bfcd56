"""Graph passes of the ``hcp`` torch.compile backend (imported as ``hcp_compile.passes``)."""
