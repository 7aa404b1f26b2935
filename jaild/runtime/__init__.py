"""The in-jail runtime: hardens the jailed process, then runs the job's code.

Imports only the standard library, msgpack, pyseccomp, python-prctl and
``jaild.protocol`` / ``jaild.errors`` -- never daemon or client code.
"""
