-- Ingest positions that hold when Postgres or Kafka goes back in time.
--
-- ingest_offset.next_offset is where ingest resumes a partition; it is
-- written by the statement that stores the partition's records, so the rows
-- and the position commit together. Two things can make it lie:
--
-- * Postgres goes back (a failover to a replica that lagged, a restore): the
--   position moves back with the rows. That is what makes the case safe, as
--   long as ingest starts from the stored position even when the consumer
--   group's committed offset is ahead, and notices the move while running:
--   every batch insert now checks that the position is still where its
--   writer left it (sql/queries/ingest_insert.sql).
-- * Kafka goes back (the topic deleted and created again, a partition
--   truncated): offsets are reused, so a new record would take an old one's
--   source coordinates and be skipped as stored. The partition's epoch,
--   bumped when ingest finds the high-water mark below the stored position
--   or a new topic id, tells them apart: it is part of the source
--   coordinates of every row stored from then on.
--
-- topic_id is the topic's id as the broker reports it (Kafka 2.8+), or NULL
-- where the broker gives none.
ALTER TABLE ingest_offset
    ADD COLUMN epoch int NOT NULL DEFAULT 0,
    ADD COLUMN topic_id text;

ALTER TABLE deferred_message ADD COLUMN source_epoch int NOT NULL DEFAULT 0;

-- The same columns as before plus the epoch: rows stored before this
-- migration have epoch 0, as their partition's position has.
ALTER TABLE deferred_message
    DROP CONSTRAINT deferred_message_source_unique,
    ADD CONSTRAINT deferred_message_source_unique
        UNIQUE (source_topic, source_partition, source_epoch, source_offset);

-- The ids and seqs a database that went back in time hands out again.
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
CREATE FUNCTION deferred_sequences_advance(min_id bigint, min_seq bigint,
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
