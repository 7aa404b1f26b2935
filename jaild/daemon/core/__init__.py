"""The daemon's pure core: decisions without IO (no sockets, files, clocks or processes).

admission (a request and a policy -> the job's terms, or a typed refusal), machine (a jail's
lifecycle, events in, actions out), broker (the rules every tool call passes), classify (how
a job ended), records (the one place result records are built), peer (who is connected).
"""
