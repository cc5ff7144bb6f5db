-- Move the stored ingest position of topic $1, partition $2 to next offset
-- $5 and epoch $6, with topic id $7 (NULL: none known), if it is still
-- ($3, $4); $3 = -1 expects no position stored and creates it. Ingest does
-- this when a claim starts somewhere the stored position does not say: at
-- the log start because retention deleted what the position points at, or
-- at a new epoch because the partition was re-created. Writing it at once
-- makes the report happen once, not at every start, and makes the epoch
-- bump survive a crash before the first batch. Returns whether it moved:
-- false means another writer changed the position meanwhile.
WITH moved AS (
    UPDATE ingest_offset SET next_offset = $5, epoch = $6, topic_id = $7, updated_at = now()
    WHERE topic = $1 AND partition = $2 AND next_offset = $3 AND epoch = $4
    RETURNING 1
), created AS (
    INSERT INTO ingest_offset (topic, partition, next_offset, epoch, topic_id)
    SELECT $1, $2, $5, $6, $7 WHERE $3::bigint = -1
    ON CONFLICT (topic, partition) DO NOTHING
    RETURNING 1
)
SELECT EXISTS (SELECT FROM moved) OR EXISTS (SELECT FROM created) AS moved
