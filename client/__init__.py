"""tether.client: the edge end of tether (drafter runtime, state machine, offline drafting, resync, CLI).

Never imports triton or tether.server: the edge build must install and run without GPU code.
"""
