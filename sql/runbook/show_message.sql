-- show_message.sql: one message's story.
--
-- What: four results for message :id.
--   1. The row: where it goes and when, its state and why, the error the
--      producer deferred it for, where it was read, when it was parked and
--      whether it holds its key then, its dead-letter copy, how many times it
--      was replayed, whether it is the head of its key (holds_key: a parked
--      head that holds it) and how many pending messages of its key are ahead
--      of it and wait behind it, and its record key and value (text when they
--      are valid UTF-8, else \x and hex; key_encoding and value_encoding say
--      which; empty when absent).
--   2. Its headers in order, decoded the same way, from the view
--      deferred_message_header.
--   3. Its lineage: the message it re-defers (origin_id) if that row still
--      exists, and the rows that re-defer it (deferred_message_origin, a
--      partial index of the rows that have an origin).
--   4. Its lineage's history, as history.sql prints it: every time one of
--      its messages was deferred, parked, rejected, replayed, expedited,
--      published or cancelled, and who acted.
-- When: a question about one message ("why has 1234 not gone out?").
-- Call:
--   psql "$DATABASE_URL" -v id=1234 -f sql/runbook/show_message.sql
-- (add -x for one field per line). The \x-and-hex test below is a UTF-8
-- validator on the hex encoding, since PostgreSQL 15 has no built-in one.
WITH utf8 (valid) AS (
    VALUES ('^(?:0[1-9a-f]|[1-7][0-9a-f]|c[2-9a-f][89ab][0-9a-f]|d[0-9a-f][89ab][0-9a-f]'
            '|e0[ab][0-9a-f][89ab][0-9a-f]|e[1-9a-c][89ab][0-9a-f][89ab][0-9a-f]|ed[89][0-9a-f][89ab][0-9a-f]'
            '|e[ef][89ab][0-9a-f][89ab][0-9a-f]|f0(?:9[0-9a-f]|[ab][0-9a-f])[89ab][0-9a-f][89ab][0-9a-f]'
            '|f[1-3][89ab][0-9a-f][89ab][0-9a-f][89ab][0-9a-f]|f48[0-9a-f][89ab][0-9a-f][89ab][0-9a-f])*$')
)
SELECT m.id,
       m.business_key,
       m.seq,
       m.target_topic,
       m.state,
       m.next_run_at,
       m.attempt,
       m.reason,
       m.error_class,
       m.error_message,
       m.origin_id,
       m.created_at,
       m.updated_at,
       m.source_topic,
       m.source_partition,
       m.source_offset,
       m.parked_at,
       m.park_holds_key,
       m.dlq_topic,
       m.dlq_published_at,
       m.redrive_count,
       coalesce(k.held, false) AS holds_key,
       CASE WHEN k.head_id IS NOT NULL AND m.business_key IS NOT NULL THEN (
           SELECT count(*) FROM deferred_message b
           WHERE b.business_key = m.business_key AND b.state = 'pending'
             AND (b.seq, b.id) > (m.seq, m.id))
       END AS waiting_behind,
       k.head_id IS NOT NULL AS is_head,
       CASE WHEN m.state = 'pending' AND m.business_key IS NOT NULL THEN (
           SELECT count(*) FROM deferred_message a
           WHERE a.business_key = m.business_key AND a.state = 'pending'
             AND (a.seq, a.id) < (m.seq, m.id))
       END AS pending_ahead,
       CASE WHEN m.key IS NULL THEN NULL WHEN encode(m.key, 'hex') ~ u.valid THEN 'text' ELSE 'hex' END AS key_encoding,
       CASE WHEN encode(m.key, 'hex') ~ u.valid THEN convert_from(m.key, 'UTF8') ELSE '\x' || encode(m.key, 'hex') END AS key,
       octet_length(m.value) AS value_bytes,
       CASE WHEN m.value IS NULL THEN NULL WHEN encode(m.value, 'hex') ~ u.valid THEN 'text' ELSE 'hex' END AS value_encoding,
       CASE WHEN encode(m.value, 'hex') ~ u.valid THEN convert_from(m.value, 'UTF8') ELSE '\x' || encode(m.value, 'hex') END AS value
FROM deferred_message m
CROSS JOIN utf8 u
LEFT JOIN deferred_key k ON k.head_id = m.id
WHERE m.id = :id;

WITH utf8 (valid) AS (
    VALUES ('^(?:0[1-9a-f]|[1-7][0-9a-f]|c[2-9a-f][89ab][0-9a-f]|d[0-9a-f][89ab][0-9a-f]'
            '|e0[ab][0-9a-f][89ab][0-9a-f]|e[1-9a-c][89ab][0-9a-f][89ab][0-9a-f]|ed[89][0-9a-f][89ab][0-9a-f]'
            '|e[ef][89ab][0-9a-f][89ab][0-9a-f]|f0(?:9[0-9a-f]|[ab][0-9a-f])[89ab][0-9a-f][89ab][0-9a-f]'
            '|f[1-3][89ab][0-9a-f][89ab][0-9a-f][89ab][0-9a-f]|f48[0-9a-f][89ab][0-9a-f][89ab][0-9a-f])*$')
)
SELECT h.position,
       h.key,
       CASE WHEN h.value IS NULL THEN NULL WHEN encode(h.value, 'hex') ~ u.valid THEN 'text' ELSE 'hex' END AS encoding,
       CASE WHEN encode(h.value, 'hex') ~ u.valid THEN convert_from(h.value, 'UTF8') ELSE '\x' || encode(h.value, 'hex') END AS value
FROM deferred_message_header h
CROSS JOIN utf8 u
WHERE h.id = :id
ORDER BY h.position;

SELECT l.relation, l.id, l.business_key, l.seq, l.target_topic, l.state, l.next_run_at, l.attempt, l.reason
FROM (SELECT 'origin' AS relation, l.*
      FROM deferred_message m
      JOIN deferred_message l ON l.id = m.origin_id
      WHERE m.id = :id
      UNION ALL
      SELECT 're-deferral', l.*
      FROM deferred_message l
      WHERE l.origin_id = :id) l
ORDER BY l.id;

SELECT h.lineage_id,
       h.message_id,
       h.recorded_at,
       h.event,
       h.attempt,
       h.reason,
       h.error_class,
       h.error_message,
       h.target_topic,
       h.next_run_at,
       h.partition,
       h.record_offset,
       h.actor
FROM deferred_lineage_history(deferred_lineage(:id)) h
ORDER BY h.recorded_at, h.id NULLS LAST, h.event <> 'deferred';
