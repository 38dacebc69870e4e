"""The id registries of the custom ops (`ops._Ids`): an entry lives while a holder's objects do, and a holder's death
changes nothing that `get` reads until the next registration or count (a weakref callback can fire while
torch.compile traces `get`, and dynamo guards on what it read)."""

import gc

from tq_hf_cache import ops


class Obj:
    pass


def test_a_dead_holder_is_swept_at_the_next_registration_not_in_its_callback():
    ids = ops._Ids("test")
    a, b = Obj(), Obj()
    key = ("identity", id(a))
    oid = ids.id_for(key, a)
    ids.id_for(("content", 1), b)
    refs = ids._refs[oid]
    del a
    gc.collect()
    assert ids._refs[oid] is refs and len(refs) == 1, "the callback edited the list get reads"
    assert len(ids) == 1 and oid not in ids._refs and key not in ids._ids  # counted after a sweep
    c = Obj()
    oid_c = ids.id_for(("identity", id(c)), c)
    assert oid_c != oid and ids.get(oid_c) == (c,)  # never an old id for a new object
