"""The two wire formats, one module per link.

- `gemini.wire.hook`: libgemhook <-> gem-pmgr, fixed binary frames declared in hook/gemini_proto.h (cffi).
- `gemini.wire.sched`: gem-pmgr (and gem-ctl) <-> gem-schd, JSON messages over zmq.
"""
