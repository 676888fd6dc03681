"""Triton kernels with their pure-PyTorch references and autograd wrappers; imports only torch and triton."""
