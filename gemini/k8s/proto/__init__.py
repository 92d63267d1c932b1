"""The kubelet APIs gemini speaks: the .proto files written for gemini and the modules generated from them."""
