"""The service's cache of run-directory reads against the supervisor, which holds the registry's lock while it
forgets a run's cached reads."""

import threading

from service.rundir import RunFilesCache


def test_get_never_holds_the_cache_lock_while_it_reads_the_registry(tmp_path):
    """get() read the carried counts (the registry's lock) inside the cache's lock while the supervisor, holding the
    registry's lock, called forget() (the cache's lock): the two deadlocked and the service stopped answering."""
    registry_lock = threading.RLock()
    reading = threading.Event()

    def carried(run_id):
        reading.set()
        with registry_lock:
            return {"restart": 1}, {}

    cache = RunFilesCache(tmp_path, carried)
    with registry_lock:  # the supervisor's pass
        getter = threading.Thread(target=cache.get, args=("a",), daemon=True)
        getter.start()
        assert reading.wait(5)
        forgot = threading.Thread(target=cache.forget, args=("a",), daemon=True)
        forgot.start()
        forgot.join(5)
        assert not forgot.is_alive(), "forget() waited on a get() that waits on the registry: deadlock"
    getter.join(5)
    assert not getter.is_alive()
    assert cache.get("a")._event_counts == {"restart": 1}


def test_a_get_across_a_forget_reads_the_carried_counts_again(tmp_path):
    counts = iter([({"restart": 1}, {}), ({"restart": 2}, {})])
    cache = None

    def carried(run_id):
        got = next(counts)
        if got[0]["restart"] == 1:
            cache.forget(run_id)  # an attempt set aside while the first read was under way
        return got

    cache = RunFilesCache(tmp_path, carried)
    assert cache.get("a")._event_counts == {"restart": 2}
