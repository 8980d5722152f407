"""tether.netsim: the network harness, a TCP proxy with a live-controllable link, scenarios and `tether-netsim`.

Stdlib only, so the edge client's tests and the demo can put it between any client and server.
"""
