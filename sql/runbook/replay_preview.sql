-- replay_preview.sql: what replay.sql would move, changing nothing.
--
-- What: the messages in state :'state' (parked or rejected) that match every
-- filter given, oldest first: when each was parked (parked_at; for a rejected
-- message, when it was last changed), whether it holds its business key, and
-- whether it can be replayed at all (a rejected record that named no target
-- topic cannot: set target_topic first). Filters, each empty for "any":
--   ids          message ids, comma-separated
--   target       target_topic LIKE this pattern (% any run, _ one character,
--                \ escapes; `scheduler replay --target` takes a glob instead)
--   key          business key, exact
--   error_class  error_class LIKE this pattern
--   reason       reason code, exact: the part of the reason before the first
--                colon (unknown_topic, exhausted, permanent, ...)
--   since/until  parked (or rejected) at or after since, before until, as
--                timestamps ('2024-05-01 12:00+00', or now() - 1 hour
--                computed by hand)
-- `scheduler replay --dry-run` runs this file. It reads the parked or
-- rejected rows only (an index covers them).
-- When: before replay.sql, to see what it would move.
-- Call:
--   psql "$DATABASE_URL" -v state=parked -v ids= -v target='payments.%' -v key= -v error_class= \
--        -v reason=unknown_topic -v since= -v until= -f sql/runbook/replay_preview.sql
SELECT m.id,
       m.business_key,
       m.seq,
       m.target_topic,
       m.state,
       m.reason,
       m.error_class,
       m.attempt,
       m.redrive_count,
       coalesce(m.parked_at, m.updated_at) AS since,
       EXISTS (SELECT 1 FROM deferred_key k WHERE k.head_id = m.id AND k.held) AS holds_key,
       coalesce(m.target_topic, '') <> '' AS replayable
FROM deferred_message m
WHERE m.state = :'state'
  AND (:'ids'::text = '' OR m.id = ANY (string_to_array(:'ids', ',')::bigint[]))
  AND (:'target'::text = '' OR m.target_topic LIKE :'target')
  AND (:'key'::text = '' OR m.business_key = :'key')
  AND (:'error_class'::text = '' OR m.error_class LIKE :'error_class')
  AND (:'reason'::text = '' OR split_part(m.reason, ':', 1) = :'reason')
  AND coalesce(m.parked_at, m.updated_at) >= coalesce(nullif(:'since', '')::timestamptz, '-infinity')
  AND coalesce(m.parked_at, m.updated_at) < coalesce(nullif(:'until', '')::timestamptz, 'infinity')
ORDER BY since, m.id;
