-- The stored ingest positions of topic $1 for partitions $2: the next offset
-- to read, the partition's epoch and the topic id seen when it was last set
-- (NULL: the broker gave none, or the row predates migration 0005).
-- Partitions never ingested have no row.
SELECT partition, next_offset, epoch, topic_id FROM ingest_offset WHERE topic = $1 AND partition = ANY ($2::int[])
