-- How far ingest has stored every partition of topic $1: the next offset
-- it reads. The key-state query reads it before the keys' state, so that
-- its answer covers every record below these offsets (internal/keygate).
SELECT partition, next_offset FROM ingest_offset WHERE topic = $1
