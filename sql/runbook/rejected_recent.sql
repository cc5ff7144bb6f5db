-- rejected_recent.sql: what ingest rejected lately, by reason.
--
-- What: rejected messages stored within :'window' (an interval: '1 hour',
-- '15 minutes', '2 days') counted by reason code (the part of the reason before
-- the colon, e.g. missing_target), most frequent first, with the latest time
-- each was seen. `scheduler status` shows the last hour.
-- When: a producer may be sending malformed records; the codes are listed in
-- the README ("Bad input"). list.sql with state=rejected shows the rows.
-- Call:
--   psql "$DATABASE_URL" -v window='1 hour' -f sql/runbook/rejected_recent.sql
SELECT split_part(coalesce(reason, ''), ':', 1) AS reason,
       count(*) AS messages,
       max(created_at) AS latest
FROM deferred_message
WHERE state = 'rejected'
  AND created_at > now() - :'window'::interval
GROUP BY 1
ORDER BY messages DESC, reason;
