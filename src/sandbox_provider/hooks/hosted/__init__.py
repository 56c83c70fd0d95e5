"""
What several backends share beyond the contract: ``service`` (a connection of their own checked and read,
settings resolved over its extras; for the hosted services, Islo and Boat, a retry loop that never outlasts
its deadline, ``Retry-After`` and the errors a status means) and ``deadline_run`` (a command run under the
shared ``run_with_deadline.sh``, for services that cannot stream or stop a command themselves).
"""
