-- deferred_key_notify wakes sleeping dispatchers when a head that is not
-- leased becomes due within the longest poll interval (5 s): a head further
-- out is found by the next poll anyway. Notifications are only a hint.

CREATE OR REPLACE FUNCTION deferred_key_notify(earliest timestamptz) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF earliest IS NOT NULL AND earliest <= now() + interval '5 seconds' THEN
        PERFORM pg_notify('deferred_key_due', '');
    END IF;
END
$$;
