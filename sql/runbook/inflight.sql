-- inflight.sql: keys waiting for their consumer group to commit.
--
-- What: the rows of deferred_inflight, oldest first: for each consumer
-- group (defer.group) and business key, the target partition and offset of
-- the key's last record the scheduler republished there, the message it
-- was, when it went out and how long ago. While a key is listed, the
-- key-state query answers in_flight for that group: the group's consumers
-- have not committed past that record yet. The scheduler reads each
-- group's committed offsets about once a second and releases what they
-- passed, so rows older than a few seconds mean the group is not
-- committing: it is stopped, lagging far behind, deleted or renamed.
-- Filters, each empty for "any": group (exact), key (exact); limit is how
-- many rows at most (empty: all). `scheduler inflight` runs this file, and
-- `scheduler release --dry-run` to say what it would release.
-- When: scheduler_inflight_oldest_seconds grows (alert
-- SchedulerInflightStuck), or a consumer says a key stays blocked.
-- Call:
--   psql "$DATABASE_URL" -v group= -v key= -v limit=100 -f sql/runbook/inflight.sql
--   psql "$DATABASE_URL" -v group=payment-service -v key= -v limit= -f sql/runbook/inflight.sql
SELECT group_id,
       business_key,
       target_topic,
       partition,
       record_offset,
       message_id,
       seq,
       published_at,
       date_trunc('second', now() - published_at) AS age,
       extract(epoch FROM now() - published_at)::float8 AS age_seconds
FROM deferred_inflight
WHERE (:'group'::text = '' OR group_id = :'group')
  AND (:'key'::text = '' OR business_key = :'key')
ORDER BY published_at, group_id, business_key, target_topic, partition
LIMIT nullif(:'limit', '')::bigint;
