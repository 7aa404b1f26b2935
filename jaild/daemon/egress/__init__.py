"""Egress by name: the gateway (one door per jail: CONNECT tunnels, plain HTTP, interception
to add credentials), its daemon side (service: trust bundle, secrets, a door per jail and run)
and the interception CA (ca)."""
