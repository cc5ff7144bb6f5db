-- deferred_key_notify wakes sleeping dispatchers when a head that is not
-- leased becomes due within the longest poll interval (5 s): a head further
-- out is found by the next poll anyway. Notifications are only a hint.
--
-- The payload says when (migration 0018): empty for a head due now, else
-- the milliseconds until it falls due by the database clock, rounded up.
-- The listener (internal/runner's Waker) then wakes a loop at that time,
-- not at once: a loop woken for a head due later claims nothing, and then
-- sleeps at least 20 ms (internal/dispatch's minIdle) whenever the head
-- falls due. A relative time, not the due time itself, so that a skew
-- between the hosts' clocks cannot shift it; what it does not count is the
-- time from here to the commit and to the listener, so it wakes late
-- rather than early.

CREATE OR REPLACE FUNCTION deferred_key_notify(earliest timestamptz) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    wait interval;
BEGIN
    IF earliest IS NOT NULL AND earliest <= now() + interval '5 seconds' THEN
        wait := earliest - clock_timestamp();
        PERFORM pg_notify('deferred_key_due',
                          CASE WHEN wait > interval '0' THEN ceil(extract(epoch FROM wait) * 1000)::bigint::text
                               ELSE '' END);
    END IF;
END
$$;
