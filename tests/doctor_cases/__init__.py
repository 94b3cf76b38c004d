"""A corpus of small training steps, each with one known capture breaker.

Every case defines ``make() -> (step, args)``; the breaking line carries a
``# doctor: <category>`` marker, which tests/integration/test_doctor.py compares with
what ``graphstep.doctor.check(step, *args)`` reports.
"""
