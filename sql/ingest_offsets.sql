-- The next offsets to read, per partition, of topic $1 for partitions $2.
SELECT partition, next_offset FROM ingest_offset WHERE topic = $1 AND partition = ANY ($2::int[])
