-- deferred_sequences_advance: the ids and seqs a database that went back in
-- time hands out again.
--
-- deferred_message.id (defer.id on output) and seq come from sequences,
-- which go back with everything else. Records read again after a rewind
-- are stored with ids drawn again from the point the database went back
-- to, and the messages published since then, whose rows are gone, carried
-- those very ids: a consumer that dedupes on defer.id, as the README tells
-- it to, would drop a message as a copy of another. So every process
-- remembers the highest id and seq it has seen (from ingest's own inserts,
-- from its claims, and from reading both sequences every second) and moves
-- the sequences past them, if they are behind, before each ingest insert
-- and with each heartbeat (internal/highwater).
--
-- Behind means only a rewind: a value a process saw came from the
-- sequence. When behind, the sequence moves to the value seen plus a
-- margin: setval is not atomic with concurrent nextval calls, and the
-- margin covers what other sessions take between the read and the setval.
-- An advisory lock keeps two processes from moving it at once (the later,
-- lower setval would undo the higher one). It runs as its owner (SECURITY
-- DEFINER): setval needs UPDATE on the sequence, which the service role
-- does not have (sql/roles). Returns both sequences' values afterwards.

CREATE OR REPLACE FUNCTION deferred_sequences_advance(min_id bigint, min_seq bigint,
                                           OUT id_high bigint, OUT seq_high bigint)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
DECLARE
    margin constant bigint := 10000;
BEGIN
    SELECT last_value INTO id_high FROM deferred_message_id_seq;
    SELECT last_value INTO seq_high FROM deferred_message_seq;
    IF id_high >= min_id AND seq_high >= min_seq THEN
        RETURN;
    END IF;
    -- "deferred" in ASCII: a key no other user of the database takes.
    PERFORM pg_advisory_xact_lock(x'6465666572726564'::bigint);
    SELECT last_value INTO id_high FROM deferred_message_id_seq;
    IF id_high < min_id THEN
        id_high := setval('deferred_message_id_seq', min_id + margin);
    END IF;
    SELECT last_value INTO seq_high FROM deferred_message_seq;
    IF seq_high < min_seq THEN
        seq_high := setval('deferred_message_seq', min_seq + margin);
    END IF;
END
$$;
