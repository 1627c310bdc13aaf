"""Placeholder until the kernel lands (being written in this session)."""


def mla_decode(*a, **k):
    raise NotImplementedError


paged_mla_decode = mla_decode
