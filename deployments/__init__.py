"""Ray Serve deployment of dart-ray: an OpenAI-compatible server (``build_app``), placement options
for tensor-parallel replicas, and ``run_local`` behind ``dart-ray serve``.

Importing this package does not import Ray; import the submodules you need.
"""
