-- deferred_lineage(message_id): the lineage of a message, the id that its
-- history rows carry as lineage_id and deferred_lineage_history takes. A
-- lineage is a message and every re-deferral of it (records carrying
-- defer.id of an earlier row); its id is the id of the first message.
--
-- The message's first history row names it. A message with no history row
-- yet (stored pending and left alone since, migration 0012) is in its
-- origin's lineage, and so on up the chain: the first history row of the
-- first message up it that has one, else the first message up it whose
-- row is gone or has no origin (a first deferral, or an origin whose
-- history was pruned). The history triggers and dispatch's finalize name
-- a re-deferral's lineage with this, from its origin: a re-deferral can
-- be stored before the finalize that published its origin commits (the
-- consumer was quick), when the origin has its row but no history yet,
-- and its lineage is then its origin's origin's. Each step is one or two
-- index probes; chains of messages without history are one or two long.
--
-- STABLE: its statements read the calling statement's snapshot, so the
-- origin is seen either with its row or with its 'published' row, which
-- its finalize writes in the transaction that deletes the row.

CREATE OR REPLACE FUNCTION deferred_lineage(message_id bigint) RETURNS bigint
LANGUAGE plpgsql STABLE AS $$
DECLARE
    cur bigint := message_id;
    lineage bigint;
    origin bigint;
BEGIN
    -- A bound, not a need: origin chains have no cycles, since a row names
    -- an origin stored before it.
    FOR i IN 1..100 LOOP
        SELECT a.lineage_id INTO lineage FROM deferred_attempt a
        WHERE a.message_id = cur ORDER BY a.message_id, a.id LIMIT 1;
        IF lineage IS NOT NULL THEN
            RETURN lineage;
        END IF;
        SELECT m.origin_id INTO origin FROM deferred_message m WHERE m.id = cur;
        IF origin IS NULL THEN
            RETURN cur;
        END IF;
        cur := origin;
    END LOOP;
    RETURN cur;
END
$$;
