"""The pure-PyTorch reference of every op: the fallback path and the definition of correct.

Each function is named like its op (v4_<op>), computes faithfully in float32, and its
docstring gives the math, the shapes and the Hugging Face source it matches.
"""
