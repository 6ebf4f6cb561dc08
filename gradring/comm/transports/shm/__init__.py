"""The shared-memory transport for ranks on one host.

``transport`` (the rank's end of the group), ``layout`` (every offset of the
control segment), ``mailbox`` (point-to-point slots), ``status`` (what a rank
tells its peers), ``segments`` (named shared-memory segments), ``futex``
(waits and wake-ups), ``rendezvous`` (connecting through the store).
"""
